"""Translation between the core types (services/common/types.py) and the protobuf messages of
each link: one module per link, plus what common.proto gives them all. Only these modules and
the gRPC shells import the generated stubs."""
