"""The `tpu-estimator` command line: argument parsing and job configs."""
