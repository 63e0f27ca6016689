"""The benchmarks and studies (benchmarks/README.md). Most are scripts run as `python benchmarks/X.py`;
the GPU check is a package run as `python3 -m benchmarks.gpu_check` from the checkout (this file makes
`benchmarks` a regular package, so that no other `benchmarks` on sys.path shadows it)."""
