"""The export pipeline: a Hugging Face checkpoint in, lowered QNN programs handed to the artifact writer."""
