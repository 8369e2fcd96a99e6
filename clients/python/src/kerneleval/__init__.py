"""kerneleval: client library for the kerneleval gRPC service."""
