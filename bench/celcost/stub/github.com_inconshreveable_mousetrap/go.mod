module github.com/inconshreveable/mousetrap
