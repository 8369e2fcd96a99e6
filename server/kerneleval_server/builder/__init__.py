"""The builder: compiles what jobs ask to build (load_inline extensions) outside their
processes, fast, and never twice (build_cache.py)."""
