"""The local stack: simulators, the EPP and Envoy as supervised child processes on 127.0.0.1."""
