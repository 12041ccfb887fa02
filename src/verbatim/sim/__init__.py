"""The router simulator: a fleet of replica models (prefix cache, queue, batching) under a workload of
multi-turn sessions, routed by the same pure `engine.routing` decisions as the real router, and the
replay of real runs against it."""
