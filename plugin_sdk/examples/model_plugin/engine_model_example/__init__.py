"""An example model plugin: GPT-NeoX (Pythia) checkpoints on any platform, through ``engine_plugin_sdk``."""
