"""The build wing: what is compiled for jobs outside their own processes, and kept.

- `prebuild.py`: which jobs are built ahead (by a build process) and launched by a launch
  process; `compile_cache.py`: what jobs compiled and build processes built, kept for later
  jobs with the same code; `build_cache.py`: built extensions on disk by content address;
- `extension_builds.py`: jobs' `load_inline` calls queued for build processes (the compiling
  itself is `kerneleval_server.fast_build`);
- with a shared store: `artifact_store.py` (a node's side: build requests, the shared
  artifacts), `ahead_builds.py` (what a job built ahead asks and keeps), `builder_node.py`
  (`--role builder`, a builder: the one thing "builder" names).
"""
