module github.com/google/gofuzz
