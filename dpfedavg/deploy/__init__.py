"""Deployment helpers: credentials (TLS, SuperNode keys) and a loopback federation of real processes."""

from dpfedavg.deploy.credentials import Credentials, generate_credentials, generate_supernode_key

__all__ = ["Credentials", "generate_credentials", "generate_supernode_key"]
