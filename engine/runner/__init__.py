"""The model runner: one step's batch built on the device, the forward, sampling and the
copies between the cache's tiers (device, host, disk)."""
