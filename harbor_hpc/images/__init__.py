"""Task images: hashing build contexts, building and pushing one image per context, registries."""
