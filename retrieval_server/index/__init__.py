"""Index building and the index's files: the corpus format and the embedded corpus, the encoder,
`hdr index build|convert|import` and the index directory they write, opened for serving."""
