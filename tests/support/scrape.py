"""A service's Prometheus metrics as the end-to-end tests read them, checked on the way for the
labels every vmesh series must carry."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from vmesh.services.common.model_loading import EMBEDDED_MODEL_NAME


def scrape_families(url: str) -> dict[str, list]:
    """Family name (counters without `_total`) -> its samples. Every sample must carry the
    model_name label (vLLM's dashboards filter on it), and none may be a `_created` series."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    families = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vmesh:"):
            continue  # the process and platform collectors, if any
        for sample in family.samples:
            assert sample.labels.get("model_name") == EMBEDDED_MODEL_NAME, (url, sample)
            assert not sample.name.endswith("_created"), (url, sample)
        families[family.name] = family.samples
    return families


def scrape(url: str) -> dict[str, float]:
    """Sample name (with its labels but model_name and le) -> value, buckets left out."""
    samples = {}
    for family_samples in scrape_families(url).values():
        for sample in family_samples:
            if "le" in sample.labels:
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples
