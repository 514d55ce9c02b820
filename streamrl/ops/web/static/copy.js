// The copy buttons: copy the text of the item they belong to (folded text included).
document.addEventListener("click", (event) => {
  const button = event.target.closest("button.copy");
  if (!button) return;
  const text = button.closest(".item").querySelector("pre.text");
  if (!text) return;
  navigator.clipboard.writeText(text.textContent).then(
    () => { button.textContent = "copied"; },
    () => { button.textContent = "copy failed"; },
  );
  setTimeout(() => { button.textContent = "copy"; }, 1500);
});
