"""Generated protobuf/gRPC code (by proto/generate.py; do not edit by hand)."""
