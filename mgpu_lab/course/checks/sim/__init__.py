"""The checks' simulation layer, shared by every lesson."""
