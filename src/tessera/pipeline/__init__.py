"""Pipeline parallelism: one schedule IR driving the runtime, the simulator and the pictures."""
