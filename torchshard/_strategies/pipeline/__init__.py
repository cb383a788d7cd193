"""Pipeline parallelism: the option, the loops that run stages, the schedules' registry, the binding, flag, search."""
