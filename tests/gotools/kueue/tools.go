//go:build tools

// Package tools records the Kueue command the e2e tests run, so `go mod tidy` keeps it.
package tools

import (
	_ "sigs.k8s.io/kueue/cmd/kueue"
)
