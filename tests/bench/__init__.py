"""The benchmark tools at tiny scale: workloads, reports and short end-to-end runs."""
