"""fuselens language server: graph breaks, fixes, and kernels in the editor (`python -m fuselens_lsp`)."""
__version__ = "0.1.0"
