"""kerneleval server: front end, job store, scheduler, worker runtime and kernel backends."""
