"""Readers that summarise what the tools wrote (nsys reports, manifests)."""
