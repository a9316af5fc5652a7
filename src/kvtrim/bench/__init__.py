"""Speed and memory benchmark (`kvtrim bench`)."""
