"""Storage engine: DRAM tier, NVMe tier, cache policy and the TieredStore facade."""
