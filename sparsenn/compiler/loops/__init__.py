"""The typed loop IR that lowering builds and the C++ printer prints."""
