"""Image regression: a CSV of ``file,target[,target2...]``."""
