"""Generated from proto/tiercache/v1/tiercache.proto by `make proto`; do not edit."""
