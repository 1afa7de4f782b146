"""One subprocess script per engine, run by bench/throughput.py."""
