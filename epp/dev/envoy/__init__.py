"""The Envoy in front of the EPP, for local runs and the checked-in deploy files."""
