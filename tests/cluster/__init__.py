"""Cluster tier: a real Kubernetes control plane (see controlplane.py)."""
