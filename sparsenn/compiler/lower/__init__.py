"""Lowering: a scheduled assignment to loop nests."""
