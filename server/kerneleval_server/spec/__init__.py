"""A JobSpec's rules, shared by the front end and the sandboxed engine (the ground floor: it
imports nothing of the service above it): what a valid spec and request are (validation.py)
and where a job may run (placement.py)."""
