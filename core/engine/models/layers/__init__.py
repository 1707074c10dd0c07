"""Building blocks the dense decoder architectures are assembled from.

:mod:`~engine.models.layers.spec` describes an architecture (norm placement, projection names,
activation, multipliers, per-layer window and rotary); :mod:`~engine.models.layers.rope` runs every
rotary variant; :mod:`~engine.models.layers.hf_config` reads the keys the Hub spells differently across
families; :mod:`~engine.models.layers.decoder` is the one model class that runs a spec.
"""
