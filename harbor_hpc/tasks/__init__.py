"""The task model: finding Harbor tasks under a folder, the image manifest, and edits to tasks."""
