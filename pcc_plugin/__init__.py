"""pcc-device-plugin: a Kubernetes device plugin for AMD SEV-SNP confidential-computing nodes."""

# The one place the version is written; pyproject.toml reads it from here.
__version__ = "0.1.0"
