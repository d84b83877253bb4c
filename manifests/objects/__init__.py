"""The builders of the training job's Kubernetes objects, one module per group of objects;
`manifests.render` is their public entry point."""
