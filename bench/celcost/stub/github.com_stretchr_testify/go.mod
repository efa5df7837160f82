module github.com/stretchr/testify
