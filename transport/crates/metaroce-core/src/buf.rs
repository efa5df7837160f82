//! Memory an operation works on. The C ABI lends the application's own buffers
//! (valid until the operation's completion, as libfabric requires); tests and
//! inject sends own theirs. All raw access is here, bounds-checked.

pub struct SendBuf {
    ptr: *const u8,
    len: usize,
    _owned: Option<Box<[u8]>>,
}

// SAFETY: the lender keeps the memory valid and unmodified until completion.
unsafe impl Send for SendBuf {}

impl SendBuf {
    pub fn owned(data: Vec<u8>) -> Self {
        let owned = data.into_boxed_slice();
        Self { ptr: owned.as_ptr(), len: owned.len(), _owned: Some(owned) }
    }

    /// # Safety
    /// `ptr..ptr+len` stays valid and unmodified until the send completes.
    pub unsafe fn borrowed(ptr: *const u8, len: usize) -> Self {
        Self { ptr, len, _owned: None }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn slice(&self, offset: usize, len: usize) -> &[u8] {
        assert!(offset + len <= self.len, "send slice out of bounds");
        if len == 0 {
            return &[];
        }
        // SAFETY: in bounds of memory valid for the operation's lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr.add(offset), len) }
    }
}

pub struct RecvBuf {
    ptr: *mut u8,
    len: usize,
    owned: Option<Box<[u8]>>,
}

// SAFETY: the lender keeps the memory valid until completion and does not read it.
unsafe impl Send for RecvBuf {}

impl RecvBuf {
    pub fn owned(len: usize) -> Self {
        let mut owned = vec![0u8; len].into_boxed_slice();
        Self { ptr: owned.as_mut_ptr(), len, owned: Some(owned) }
    }

    /// # Safety
    /// `ptr..ptr+len` stays valid, and unread by others, until the receive completes.
    pub unsafe fn borrowed(ptr: *mut u8, len: usize) -> Self {
        Self { ptr, len, owned: None }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Copy `data` at `offset`; whatever falls past the end is dropped (truncation).
    pub fn write(&mut self, offset: usize, data: &[u8]) {
        if offset >= self.len {
            return;
        }
        let n = data.len().min(self.len - offset);
        // SAFETY: offset + n <= len, memory valid for the operation.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), n) }
    }

    /// The owned contents (tests).
    pub fn into_vec(self) -> Option<Vec<u8>> {
        self.owned.map(|b| b.into_vec())
    }
}

impl std::fmt::Debug for SendBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SendBuf({} bytes)", self.len)
    }
}

impl std::fmt::Debug for RecvBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RecvBuf({} bytes)", self.len)
    }
}
