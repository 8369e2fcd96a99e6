"""Fast builds of load_inline extensions, as torch would build them (extension.py), in the
build processes that compile what jobs ask outside their own processes; never twice
(jobs/builds/build_cache.py). "Builder" names the role only: `--role builder`,
jobs/builds/builder_node.py."""
