"""Kubernetes: the data layer's cluster side (list/watch with kubernetes-asyncio) and leader election.

Nothing here is on the per-request path: the director reads the stores these modules fill.
"""
