"""Flow-control policies: fairness between the flows of a band, ordering within a flow, and
per-band usage limits."""
