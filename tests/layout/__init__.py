"""Rules of the source tree: layering, packaging and the wire schemas."""
