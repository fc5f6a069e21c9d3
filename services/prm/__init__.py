"""The prm service."""
