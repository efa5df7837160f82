module gopkg.in/check.v1
