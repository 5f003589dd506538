"""Task images: the Dockerfile reader, image references, hashing build contexts, building and
pushing one image per context, registries."""
