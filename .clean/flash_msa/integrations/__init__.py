"""Adapters to other frameworks, one module each, imported on their own (never by
`import flash_msa`): flash_msa.integrations.transformers."""
