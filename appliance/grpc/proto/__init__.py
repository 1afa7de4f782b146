"""Protocol definitions (.proto) and the Python stubs generated from them (`make proto`)."""
