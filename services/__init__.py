"""vmesh services: one sub-package per service, and `common` for what they share."""
