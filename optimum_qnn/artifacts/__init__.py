"""The artifact folder: writer, manifest, variant selection and verification, the Hub, inspection."""
