"""The compiler's front end: text to index notation.

``equation`` rewrites torch's einsum grammar (ellipses, ``diagonal`` repeated letters,
size-1 broadcasting) into core equations; ``notation`` defines the first IR
(:class:`~.notation.Assignment`, sums of products with values over ``functions``) and
parses core equations; ``expression`` parses :func:`sparsenn.compile`'s text into
statements and ``program`` stages them into assignments; ``notation_text`` prints an
assignment exactly and reads it back; ``blocks`` rewrites a call over blocked or n:m
operands into one over split indices; ``operators`` is SparseTensor's arithmetic in
einsums.
"""
