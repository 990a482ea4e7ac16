"""Loading a model: transformers' loader, support checks, the fingerprint, packed
projections and the demo model."""
