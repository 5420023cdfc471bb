"""Planning: output format inference, loop-order scheduling and contraction paths."""
