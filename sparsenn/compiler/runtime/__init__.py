"""Runtime: validation, plan lookup and kernel launch behind the public API."""
